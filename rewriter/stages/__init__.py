"""Inter-operator planning (Alpa's stages): layers, submeshes and the stage program, calibration."""
