"""End-to-end validation under faults: the soak (`kvshare validate soak`)."""
