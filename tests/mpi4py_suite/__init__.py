"""mpi4py's own test suite run with cma.mpi swapped in: driver.py (one module under mpiexec),
run_matrix.py (modules x numbers of ranks x plain/plugin, and the report), not_applicable.txt."""
