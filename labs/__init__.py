"""Student lab stubs: fill in each TODO, then grade with `pytest tests/labs --impl=labs`."""
