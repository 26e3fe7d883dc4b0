"""The Worker gRPC service, shared by cpu_worker and gpu_worker."""
