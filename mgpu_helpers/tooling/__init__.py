"""The course's own tooling: what runs, checks and hands out the lessons (not what they teach).

``cli`` is the ``mgpu`` command; ``runner`` executes lessons headless (``make course``, the
notebook tests) and ``report`` writes what they did; ``notebooks`` reads and cleans lesson files
(parameters cell, exercise metadata); ``student`` writes the student copy. Imports go one way:
tooling uses the lesson helpers (``mgpu_helpers.*``), and no helper module imports tooling
(``tests/test_package_imports.py`` checks it).
"""
