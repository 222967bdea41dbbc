"""Benchmarks that print JSON, each measured side by side against its baseline in the same run."""
