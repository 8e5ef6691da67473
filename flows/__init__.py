"""gristmill: flows"""
