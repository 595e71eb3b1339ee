"""Builds and runs graphs: the only package that holds a Dask client."""
