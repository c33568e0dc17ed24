"""spechead.inference"""
