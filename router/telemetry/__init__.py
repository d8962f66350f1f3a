"""What the gateway reports: metrics, logs, traces, recordings, key fidelity, calibration feed."""
