"""The ``rota`` command line: thin click commands over library functions."""
