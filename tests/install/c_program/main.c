/* A C program outside the tree, built with pkg-config against the installed tensorshm.h: as
 * tests/install/consumer, `produce SOCKET NAME` publishes 1000 doubles, `consume SOCKET NAME`
 * acquires them; each prints the sum of the values it saw. */
#include <stdio.h>
#include <string.h>
#include <tensorshm/tensorshm.h>

static int Fail(const char* what, int rc) {
  fprintf(stderr, "%s: %d %s\n", what, rc, tsm_last_error());
  return 1;
}

int main(int argc, char** argv) {
  if (argc != 4) return 2;
  tsm_client* client = NULL;
  int rc = tsm_connect(argv[2], "install_test_c", &client);
  if (rc != TSM_OK) return Fail("tsm_connect", rc);
  double sum = 0;
  if (strcmp(argv[1], "produce") == 0) {
    const DLDataType f64 = {kDLFloat, 64, 1};
    const DLDevice cpu = {kDLCPU, 0};
    const int64_t shape[1] = {1000};
    tsm_writable* tensor = NULL;
    rc = tsm_create(client, f64, 1, shape, NULL, cpu, &tensor);
    if (rc != TSM_OK) return Fail("tsm_create", rc);
    double* values = (double*)tsm_writable_data(tensor);
    for (int i = 0; i < 1000; ++i) sum += values[i] = i * 0.5;
    rc = tsm_publish(client, tensor, argv[3], 0);
    tsm_writable_free(tensor);
    if (rc != TSM_OK) return Fail("tsm_publish", rc);
  } else {
    DLManagedTensorVersioned* tensor = NULL;
    rc = tsm_acquire(client, argv[3], 0, &tensor);
    if (rc != TSM_OK) return Fail("tsm_acquire", rc);
    const double* values =
        (const double*)((const char*)tensor->dl_tensor.data + tensor->dl_tensor.byte_offset);
    for (int64_t i = 0; i < tensor->dl_tensor.shape[0]; ++i) sum += values[i];
    tensor->deleter(tensor);
  }
  tsm_client_free(client);
  printf("%.1f\n", sum);
  return 0;
}
