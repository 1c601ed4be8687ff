"""Peer engines, each run in its own subprocess (`python -m lily.bench.peers.<name>_peer`) on the same
checkpoint bytes lily loads, and measured by the same contract (lily/bench/contract.py)."""
