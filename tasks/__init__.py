"""gristmill: tasks"""
