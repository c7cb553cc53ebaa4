"""cudagym.env"""
