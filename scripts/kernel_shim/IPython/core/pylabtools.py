"""Stand-in for ``IPython.core.pylabtools``: matplotlib before 3.9 reads ``backend2gui``."""

backend2gui: dict[str, str] = {}  # no GUI event loop in a script
