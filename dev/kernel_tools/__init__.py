"""scalevec_kernels' kernels examined without a GPU: aot captures the launches a workload makes and
compiles them ahead of time for an architecture (registers, spills, shared memory, occupancy); sass
reads a compiled kernel's global loads and stores from its SASS; traffic turns those and the launch
into its memory traffic and the bytes each SM keeps in flight. kernel_record.json holds the sm_90
compile of every preset's variant that the tests read (dev/kernel_table.py --record writes it)."""
