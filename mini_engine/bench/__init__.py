"""`python -m mini_engine bench` and its workloads."""
