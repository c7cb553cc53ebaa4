"""cudagym.sandbox"""
