"""gristmill: bench"""
