"""Glue between trainers and the service, one module per trainer (optional extras: each imports
its trainer only when used). See README.md in this folder."""
