"""Deployment: convert to kernel-ready formats, export packages, load and run them, report memory."""
