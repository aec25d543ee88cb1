"""pagoda.node_agent"""
