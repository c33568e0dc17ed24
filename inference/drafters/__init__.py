"""Drafters: one interface (base.Drafter), many ways to propose token trees."""
