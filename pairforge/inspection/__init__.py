"""Looking at a finished dataset: the verbs that read one and write nothing back.

``summary`` is ``pairforge inspect`` (the manifest at a glance), ``report`` the HTML page
(its charts in ``report_plots``), ``contact_sheet`` is ``pairforge show``, ``cost`` the
price per image and its projections, ``duplicates`` what dedup dropped beside what it
kept, and ``verify`` re-reads every training tar against the manifest. Reading and
writing the files themselves is ``shards/``'s.
"""
