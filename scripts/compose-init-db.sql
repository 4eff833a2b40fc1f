-- The Prefect server keeps its own database next to the ckptstore catalog.
CREATE DATABASE prefect;
