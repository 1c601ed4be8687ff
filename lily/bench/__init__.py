"""`lily bench`: the benchmark matrix (contract.py: prompt, timing protocol, refusal rules), lily's
engine adapter (lily_engine.py), the peers in their own processes (peers/), fidelity against the fp32
reference (fidelity.py), load time and peak memory in a fresh process (memory.py), and the outputs
(report.py: JSON and table; plot.py: the plot, with matplotlib). Entry point: main.py."""
