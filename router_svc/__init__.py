"""Tandem router: sends each whole request to the worker where it should finish soonest."""
