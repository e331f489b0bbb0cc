"""Federated-learning simulation: clients, aggregators and attacks (ASAP)."""
