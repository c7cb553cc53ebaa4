"""Milestone reward, verdict types and the evaluator that produces them."""
