"""Measuring a chip for the planner: timing a transformer layer, the embedding, the head, the
optimizer and the links (:mod:`.chip_timing`), and the load other processes put on the cores
meanwhile (:mod:`.host_load`)."""
