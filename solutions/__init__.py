"""Completed labs: the same files as labs/, with every TODO filled in (what CI grades)."""
