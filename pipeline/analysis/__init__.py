"""After a job: text metrics, bootstrap, telemetry analyses, analyze(), the printed report, plots, MLflow."""
