# One image for scheduler, workers and driver: the project installed by its own set-up script.
FROM python:3.11-slim-bookworm
RUN apt-get update && apt-get install -y --no-install-recommends git && rm -rf /var/lib/apt/lists/*
WORKDIR /dagrl
COPY . .
RUN ./scripts/setup.sh
ENV PATH=/dagrl/.venv/bin:$PATH VK_ICD_FILENAMES=/dagrl/.vulkan/lvp_icd.json OMP_NUM_THREADS=1
