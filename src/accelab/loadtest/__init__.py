"""`accelab loadtest`: open/closed-loop load against an OpenAI-compatible server.

Pure parts (millisecond tests): schedule.py (arrival times), summary.py (records -> percentiles,
throughput, goodput under SLOs), findmax.py (the search, with an injected measure). The HTTP
driver is client.py (aiohttp); run.py builds the Result; plot.py draws it.
"""
