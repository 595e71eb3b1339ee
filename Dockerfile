# One image for scheduler, workers, driver and the MLflow server: the project installed by its own set-up script,
# plus the `server` extra (psycopg2-binary: the MLflow server's postgresql:// backend; not in the default install).
FROM python:3.11-slim-bookworm
RUN apt-get update && apt-get install -y --no-install-recommends git && rm -rf /var/lib/apt/lists/*
WORKDIR /dagrl
COPY . .
RUN ./scripts/setup.sh && .venv/bin/pip install -q -e ".[server]"
ENV PATH=/dagrl/.venv/bin:$PATH VK_ICD_FILENAMES=/dagrl/.vulkan/lvp_icd.json OMP_NUM_THREADS=1
