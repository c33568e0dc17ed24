"""spechead.training"""
