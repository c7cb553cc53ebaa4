"""cudagym.train"""
