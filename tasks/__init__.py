"""Task functions: plain, cluster-free code called from the Dask graphs."""
