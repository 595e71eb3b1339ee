# One image for scheduler, workers, driver and the MLflow server: the project installed by its own set-up script,
# plus the `server` extra (psycopg2-binary: the MLflow server's postgresql:// backend; not in the default install) and
# the extras named in the build argument EXTRAS.
FROM python:3.11-slim-bookworm
RUN apt-get update && apt-get install -y --no-install-recommends git && rm -rf /var/lib/apt/lists/*
WORKDIR /dagrl
COPY . .
# EXTRAS: the project's extras to install; GPU nodes: --build-arg EXTRAS=server,cuda (dask-cuda: `dask cuda worker`;
# docker-compose.gpu.yml builds every service so), a Kubernetes driver image adds kubernetes
ARG EXTRAS=server
RUN ./scripts/setup.sh && .venv/bin/pip install -q -e ".[${EXTRAS}]"
ENV PATH=/dagrl/.venv/bin:$PATH VK_ICD_FILENAMES=/dagrl/.vulkan/lvp_icd.json OMP_NUM_THREADS=1
