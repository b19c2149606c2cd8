"""kvshare advise: load or recompute. model.py (the cost model: prefill curve, pool and L2 hit costs, break-even
lengths, sessions under a router policy), calibrate.py (measuring the rates; the Inputs record), assemble.py (one run's
inputs from files, measurements and flags), report.py (Markdown, JSON, plot), cli.py (`kvshare advise`).
"""
