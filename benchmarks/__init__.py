"""Reproducible throughput comparisons: crossfeed against its peers, in one process tree."""
