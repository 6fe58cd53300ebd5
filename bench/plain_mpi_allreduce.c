/* The floor for ddp's mpi backend: the same all-reduces as
 * `ddp_bench --mode collective --backend mpi`, as bare MPI_Allreduce calls
 * from the main thread. Same sizes, iteration counts, barrier before each
 * call and slowest rank's median, so the two columns of bench/RESULTS.md's
 * raw-size table differ only by what ddp adds (bench/run_bench.py).
 *
 *   mpirun -np 2 plain_mpi_allreduce
 *
 * Prints one JSON line on rank 0. */
#include <mpi.h>

#include <stdio.h>
#include <stdlib.h>
#include <string.h>

static int by_value(const void* a, const void* b) {
  const double x = *(const double*)a, y = *(const double*)b;
  return (x > y) - (x < y);
}

static double median(double* values, int n) {
  qsort(values, (size_t)n, sizeof(double), by_value);
  return n % 2 ? values[n / 2] : 0.5 * (values[n / 2 - 1] + values[n / 2]);
}

int main(int argc, char** argv) {
  MPI_Init(&argc, &argv);
  int rank = 0;
  MPI_Comm_rank(MPI_COMM_WORLD, &rank);
  const long sizes[] = {4L << 10, 1L << 20, 8L << 20, 40L << 20};
  const int iterations[] = {1000, 100, 30, 10};
  const int warmup = 3;
  double medians[4];
  for (int s = 0; s < 4; ++s) {
    const int count = (int)(sizes[s] / 4);
    float* data = malloc(sizeof(float) * (size_t)count);
    double* times = malloc(sizeof(double) * (size_t)iterations[s]);
    for (int i = 0; i < count; ++i) data[i] = 1.0f;
    for (int i = 0; i < iterations[s] + warmup; ++i) {
      MPI_Barrier(MPI_COMM_WORLD);
      const double start = MPI_Wtime();
      MPI_Allreduce(MPI_IN_PLACE, data, count, MPI_FLOAT, MPI_SUM, MPI_COMM_WORLD);
      const double ms = (MPI_Wtime() - start) * 1000.0;
      if (i >= warmup) times[i - warmup] = ms;
    }
    double mine = median(times, iterations[s]);
    MPI_Allreduce(&mine, &medians[s], 1, MPI_DOUBLE, MPI_MAX, MPI_COMM_WORLD);
    free(times);
    free(data);
  }
  /* Back to back, as ddp_bench: 1000 4 KB calls per batch, median of 7. */
  float small[1024];
  double batches[7];
  for (int i = 0; i < 1024; ++i) small[i] = 1.0f;
  for (int batch = 0; batch < 8; ++batch) {
    MPI_Barrier(MPI_COMM_WORLD);
    const double start = MPI_Wtime();
    for (int i = 0; i < 1000; ++i) MPI_Allreduce(MPI_IN_PLACE, small, 1024, MPI_FLOAT, MPI_SUM, MPI_COMM_WORLD);
    if (batch > 0) batches[batch - 1] = (MPI_Wtime() - start) * 1000.0 / 1000;
  }
  double mine = median(batches, 7), back_to_back = 0;
  MPI_Allreduce(&mine, &back_to_back, 1, MPI_DOUBLE, MPI_MAX, MPI_COMM_WORLD);
  if (rank == 0) {
    printf("{\"impl\": \"plain-mpi\", \"mode\": \"collective\", \"bytes\": [%ld, %ld, %ld, %ld], "
           "\"median_ms\": [%.6g, %.6g, %.6g, %.6g], \"back_to_back_4kb_ms\": %.6g}\n",
           sizes[0], sizes[1], sizes[2], sizes[3], medians[0], medians[1], medians[2], medians[3], back_to_back);
  }
  MPI_Finalize();
  return 0;
}
