"""What runs where and what it costs: memory plan, describe, timing, compile cache."""
