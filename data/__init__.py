"""spechead.data"""
