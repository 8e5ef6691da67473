"""gristmill: infra"""
