// Where one thread's wall time goes, on a machine without perf, gdb or Nsight Systems: an
// LD_PRELOAD library that samples the thread named $PROBE_THREAD (e.g. `perch-engine`) every
// $PROBE_EVERY_US µs (default 500) after $PROBE_AFTER_S seconds (default 0) and writes, at the
// process's exit, the last 60,000 samples' distinct stacks with their counts to $PROBE_OUT (default /tmp/probe.txt), every
// frame as `module+offset` (symbolized afterwards with `scripts/probe_host_report.py`, where the
// modules are). Frames come from the unwinder; below a frame without unwind information (the CUDA
// driver's) the stack is read word by word for return addresses into the executable or libmlx.
// It also counts and times the calls MLX's CUDA backend makes to add kernel nodes and to cuBLASLt
// (its CUDA runtime is linked in statically: those calls are only seen by the sampler).
// For the GPU runs of docs/benchmarks.md.
//
//   cc -O2 -shared -fPIC -o probe_host.so scripts/probe_host.c -ldl -lpthread
//   PROBE_THREAD=perch-engine PROBE_AFTER_S=20 LD_PRELOAD=$PWD/probe_host.so perch bench ...
#define _GNU_SOURCE
#include <dirent.h>
#include <dlfcn.h>
#include <execinfo.h>
#include <pthread.h>
#include <signal.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/syscall.h>
#include <time.h>
#include <ucontext.h>
#include <unistd.h>

#define DEPTH 48
#define MAX_SAMPLES 60000
typedef struct {
  int n;
  void *pc[DEPTH];
} Sample;
static Sample *samples;
static int num_samples;
static volatile int sampling;
static volatile uintptr_t last_sp, stack_end;
// Text ranges whose addresses count as return addresses when the stack is read word by word.
#define MAX_RANGES 16
static uintptr_t range_lo[MAX_RANGES], range_hi[MAX_RANGES];
static int num_ranges;

static void on_signal(int sig, siginfo_t *info, void *context) {
  (void)sig;
  (void)info;
  // A ring: the last MAX_SAMPLES samples are kept (the end of a run, after loading, is what counts).
  int i = __atomic_fetch_add(&num_samples, 1, __ATOMIC_RELAXED) % MAX_SAMPLES;
  Sample *s = &samples[i];
  ucontext_t *uc = context;
  // The interrupted pc is kept plus one, as a return address is: the report symbolizes every
  // frame at its address less one (the call instruction's, for return addresses).
  uintptr_t pc = uc->uc_mcontext.gregs[REG_RIP] + 1, sp = uc->uc_mcontext.gregs[REG_RSP];
  last_sp = sp;
  void *frames[DEPTH];
  int n = backtrace(frames, DEPTH);
  // frames[0] is this handler, frames[1] the signal trampoline, frames[2] the interrupted pc.
  int k = 0;
  s->pc[k++] = (void *)pc;
  for (int j = 3; j < n && k < DEPTH; j++) s->pc[k++] = frames[j];
  if (n <= 6 && stack_end > sp) {
    // The unwinder stopped early: read the stack for return addresses into the known modules.
    s->pc[k++] = (void *)1;  // marks where read words begin
    uintptr_t end = stack_end - sp > 65536 ? sp + 65536 : stack_end;
    for (uintptr_t *w = (uintptr_t *)sp; (uintptr_t)w < end && k < DEPTH; w++) {
      for (int r = 0; r < num_ranges; r++) {
        if (*w >= range_lo[r] && *w < range_hi[r]) {
          s->pc[k++] = (void *)*w;
          break;
        }
      }
    }
  }
  s->n = k;
}

static int find_thread(const char *name) {
  DIR *d = opendir("/proc/self/task");
  if (!d) return -1;
  struct dirent *e;
  int found = -1;
  while ((e = readdir(d))) {
    if (e->d_name[0] == '.') continue;
    char path[300], comm[64] = {0};
    snprintf(path, sizeof path, "/proc/self/task/%s/comm", e->d_name);
    FILE *f = fopen(path, "r");
    if (!f) continue;
    if (fgets(comm, sizeof comm, f)) {
      comm[strcspn(comm, "\n")] = 0;
      int id = atoi(e->d_name);
      if (strcmp(comm, name) == 0 && (found < 0 || id < found)) found = id;  // the first started
    }
    fclose(f);
  }
  closedir(d);
  return found;
}

// Executable mappings of the main program and libmlx, and the mapping holding `sp`.
static void read_maps(uintptr_t sp) {
  FILE *f = fopen("/proc/self/maps", "r");
  if (!f) return;
  char line[1024], self[512] = {0};
  ssize_t len = readlink("/proc/self/exe", self, sizeof self - 1);
  if (len > 0) self[len] = 0;
  while (fgets(line, sizeof line, f)) {
    unsigned long lo, hi;
    char perms[8], path[768] = {0};
    if (sscanf(line, "%lx-%lx %7s %*s %*s %*s %767[^\n]", &lo, &hi, perms, path) < 3) continue;
    if (sp >= lo && sp < hi) stack_end = hi;
    if (perms[2] == 'x' && num_ranges < MAX_RANGES && (strstr(path, "libmlx") || strcmp(path, self) == 0)) {
      range_lo[num_ranges] = lo;
      range_hi[num_ranges++] = hi;
    }
  }
  fclose(f);
}

static void *sampler(void *arg) {
  (void)arg;
  const char *name = getenv("PROBE_THREAD");
  const char *after = getenv("PROBE_AFTER_S"), *every = getenv("PROBE_EVERY_US");
  long every_us = every ? atol(every) : 500;
  struct timespec wait = {after ? atol(after) : 0, 0};
  nanosleep(&wait, NULL);
  int tid = -1;
  for (int tries = 0; tid < 0 && tries < 600; tries++) {
    tid = find_thread(name);
    if (tid < 0) {
      struct timespec t = {0, 100000000};
      nanosleep(&t, NULL);
    }
  }
  if (tid < 0) {
    fprintf(stderr, "probe_host: no thread named %s\n", name);
    return NULL;
  }
  pid_t pid = getpid();
  sampling = 1;
  fprintf(stderr, "probe_host: sampling thread %d every %ld µs\n", tid, every_us);
  syscall(SYS_tgkill, pid, tid, SIGPROF);
  struct timespec t = {0, 20000000};
  nanosleep(&t, NULL);
  read_maps(last_sp);
  for (;;) {
    struct timespec p = {every_us / 1000000, (every_us % 1000000) * 1000};
    nanosleep(&p, NULL);
    if (syscall(SYS_tgkill, pid, tid, SIGPROF) != 0) break;  // the thread ended
  }
  return NULL;
}

__attribute__((constructor)) static void start(void) {
  if (!getenv("PROBE_THREAD")) return;
  samples = calloc(MAX_SAMPLES, sizeof(Sample));
  void *warm[4];
  backtrace(warm, 4);  // loads the unwinder outside the signal handler
  struct sigaction sa;
  memset(&sa, 0, sizeof sa);
  sa.sa_sigaction = on_signal;
  sa.sa_flags = SA_SIGINFO | SA_RESTART;
  sigaction(SIGPROF, &sa, NULL);
  pthread_t t;
  pthread_create(&t, NULL, sampler, NULL);
  pthread_detach(t);
}

// Timed calls MLX makes itself (through the dynamic linker).
typedef void *P;
static uint64_t add_kernel_count, add_kernel_ns, matmul_count, matmul_ns;
static uint64_t now(void) {
  struct timespec t;
  clock_gettime(CLOCK_MONOTONIC, &t);
  return (uint64_t)t.tv_sec * 1000000000ull + (uint64_t)t.tv_nsec;
}
int cuGraphAddKernelNode_v2(P node, P graph, P deps, size_t n, P params) {
  static int (*f)(P, P, P, size_t, P);
  if (!f) f = dlsym(RTLD_NEXT, "cuGraphAddKernelNode_v2");
  uint64_t s = now();
  int r = f(node, graph, deps, n, params);
  __atomic_add_fetch(&add_kernel_ns, now() - s, __ATOMIC_RELAXED);
  __atomic_add_fetch(&add_kernel_count, 1, __ATOMIC_RELAXED);
  return r;
}
int cublasLtMatmul(P handle, P desc, P alpha, P a, P adesc, P b, P bdesc, P beta, P c, P cdesc,
                   P d, P ddesc, P algo, P workspace, size_t workspace_size, P stream) {
  static int (*f)(P, P, P, P, P, P, P, P, P, P, P, P, P, P, size_t, P);
  if (!f) f = dlsym(RTLD_NEXT, "cublasLtMatmul");
  uint64_t s = now();
  int r = f(handle, desc, alpha, a, adesc, b, bdesc, beta, c, cdesc, d, ddesc, algo, workspace,
            workspace_size, stream);
  __atomic_add_fetch(&matmul_ns, now() - s, __ATOMIC_RELAXED);
  __atomic_add_fetch(&matmul_count, 1, __ATOMIC_RELAXED);
  return r;
}

static int by_frames(const void *a, const void *b) {
  const Sample *x = a, *y = b;
  if (x->n != y->n) return x->n - y->n;
  return memcmp(x->pc, y->pc, x->n * sizeof(void *));
}

__attribute__((destructor)) static void report(void) {
  // Only the process whose thread was sampled writes (its children inherit LD_PRELOAD).
  if (!sampling) return;
  const char *path = getenv("PROBE_OUT");
  FILE *out = fopen(path ? path : "/tmp/probe.txt", "w");
  if (!out) return;
  fprintf(out, "# cuGraphAddKernelNode_v2 %llu calls %.1f ms; cublasLtMatmul %llu calls %.1f ms\n",
          (unsigned long long)add_kernel_count, add_kernel_ns / 1e6,
          (unsigned long long)matmul_count, matmul_ns / 1e6);
  if (samples && sampling) {
    sampling = 0;
    signal(SIGPROF, SIG_IGN);
    int n = num_samples < MAX_SAMPLES ? num_samples : MAX_SAMPLES;
    qsort(samples, n, sizeof(Sample), by_frames);
    fprintf(out, "# samples %d\n", n);
    for (int i = 0; i < n;) {
      int j = i;
      while (j < n && by_frames(&samples[i], &samples[j]) == 0) j++;
      fprintf(out, "%d", j - i);
      for (int k = 0; k < samples[i].n; k++) {
        Dl_info info;
        void *pc = samples[i].pc[k];
        if (pc == (void *)1) {
          fprintf(out, " |");
        } else if (dladdr(pc, &info) && info.dli_fname) {
          const char *base = strrchr(info.dli_fname, '/');
          fprintf(out, " %s+0x%lx", base ? base + 1 : info.dli_fname,
                  (unsigned long)((uintptr_t)pc - (uintptr_t)info.dli_fbase));
        } else {
          fprintf(out, " ?+0x%lx", (unsigned long)(uintptr_t)pc);
        }
      }
      fprintf(out, "\n");
      i = j;
    }
  }
  fclose(out);
}
