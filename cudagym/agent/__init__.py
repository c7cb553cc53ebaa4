"""cudagym.agent"""
