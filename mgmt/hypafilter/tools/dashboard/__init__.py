"""The `hypafilter dashboard` web app: live shunting statistics, a per-rule view, /api JSON and Prometheus /metrics.

`collector` takes snapshots of every counter of the deployed system, `views` turns snapshots into the JSON the page
and /api show, `metrics` into Prometheus families, and `app` serves them read-only with FastAPI.
"""
