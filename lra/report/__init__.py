"""Reporting: the result rows' schema and their atomic append (``results``, written by the runner and the benches),
and what is read from the CSVs alone: the leaderboard (``leaderboard``), two leaderboards side by side
(``compare``), the charts (``plot``) and the survey's taxonomy beside the measured growth (``taxonomy``)."""
