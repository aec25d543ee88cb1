"""pagoda.operator"""
