"""ZeRO: partition math and the data-parallel strategies built on it."""
