"""Training drafters on the target's own outputs: data (data.py) and one trainer per drafter."""
