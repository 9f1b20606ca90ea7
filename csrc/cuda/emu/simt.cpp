/*
 * simt.cpp: the fibers, barriers, warp collectives, device and runtime of the CUDA
 * emulation (simt.h), the stand-ins for the few torch CUDA functions the launchers call,
 * and the hooks the tests use (ampc_emu_*).
 *
 * One launch at a time in the process (a mutex): the blocks of a grid run one after
 * another on the launching thread, the threads of a block as fibers on stacks of their
 * own, switched by a few instructions (simt_switch below: glibc's swapcontext makes a
 * system call each time, and ASan's hook on it clears the shadow of a whole stack).
 * The scheduler runs, round after round, every fiber that can run, in the order of the
 * setting, each until it waits (a barrier, a collective) or returns; a
 * barrier or a collective lets its fibers go on only in the next round, so the order
 * between two barriers is the setting's, never the arrival's. Under AddressSanitizer
 * every switch is announced to it, so the fiber stacks are checked like any other.
 */
#include <errno.h>
#include <pthread.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>

#include <vector>

#include "simt.h"
#include "torch_shim.h"

#if defined(__SANITIZE_ADDRESS__)
#include <sanitizer/asan_interface.h>
#include <sanitizer/common_interface_defs.h>
#define SIMT_ASAN 1
#else
#define SIMT_ASAN 0
#endif

#define EXPORT extern "C" __attribute__((visibility("default")))
#define MAX_THREADS 1024
#define WARP 32
/* a thread's frame holds its copy of the kernel arguments (32 KB) beside ASan's redzones */
#define STACK_BYTES (256 * 1024)

namespace simt {

const uint3 *self_idx;
uint3 block_idx;
uint3 block_dim;
uint3 grid_dim;

}  // namespace simt

namespace {

// ---- the device ----

struct device {
    const char *name;
    int sms;
    int major, minor;
    int driver;             /* CUDA version of the driver, 1000 * major + 10 * minor */
    size_t param_limit;     /* kernel argument bytes this driver and device take */
};

const device H200 = {"h200", 132, 9, 0, 13000, 32764};
const device SM80 = {"sm80", 108, 8, 0, 12000, 4096};

const device &the_device()
{
    static const device *d = nullptr;
    if (!d) {
        const char *v = getenv("AMPC_EMU_DEVICE");
        d = v && strcmp(v, "sm80") == 0 ? &SM80 : &H200;
    }
    return *d;
}

thread_local cudaError_t last_error = cudaSuccess;

cudaError_t set_error(cudaError_t e)
{
    if (e != cudaSuccess)
        last_error = e;
    return e;
}

[[noreturn]] __attribute__((format(printf, 1, 2))) void die(const char *fmt, ...)
{
    va_list ap;
    va_start(ap, fmt);
    fprintf(stderr, "cuda-emu: ");
    vfprintf(stderr, fmt, ap);
    fprintf(stderr, "\n");
    va_end(ap);
    fflush(stderr);
    abort();
}

// ---- the schedule ----

enum order { FORWARD, REVERSE, SHUFFLE };
int g_order = -1;
uint64_t g_seed = 1;
int g_execute = 1;          /* 0: launches are checked and recorded, blocks not run */

void read_settings()
{
    if (g_order >= 0)
        return;
    const char *o = getenv("AMPC_EMU_ORDER");
    const char *s = getenv("AMPC_EMU_SEED");
    g_order = !o || !*o || strcmp(o, "forward") == 0 ? FORWARD
            : strcmp(o, "reverse") == 0 ? REVERSE
            : strcmp(o, "shuffle") == 0 ? SHUFFLE : -1;
    if (g_order < 0)
        die("AMPC_EMU_ORDER must be forward, reverse or shuffle, got %s", o);
    if (s && *s)
        g_seed = strtoull(s, nullptr, 10);
}

uint64_t next_random()
{
    /* splitmix64: small, and the same sequence for the same seed */
    uint64_t z = (g_seed += 0x9e3779b97f4a7c15ull);
    z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ull;
    z = (z ^ (z >> 27)) * 0x94d049bb133111ebull;
    return z ^ (z >> 31);
}

/* ids[0..n) in the setting's order */
void arrange(std::vector<int> &ids)
{
    size_t n = ids.size();
    if (g_order == REVERSE) {
        for (size_t i = 0; i < n / 2; i++)
            std::swap(ids[i], ids[n - 1 - i]);
    } else if (g_order == SHUFFLE) {
        for (size_t i = n; i > 1; i--)
            std::swap(ids[i - 1], ids[next_random() % i]);
    }
}

// ---- fibers ----

#if !defined(__x86_64__)
#error "the CUDA emulation switches fibers with x86-64 code"
#endif

/* simt_switch(&save, to): saves the callee-saved registers, the SSE and x87 control words
 * and the stack pointer in *save, then resumes the fiber whose stack pointer is `to`. */
extern "C" void simt_switch(void **save, void *to);
asm(R"(
    .text
    .globl simt_switch
    .hidden simt_switch
    .type simt_switch, @function
simt_switch:
    pushq %rbp
    pushq %rbx
    pushq %r12
    pushq %r13
    pushq %r14
    pushq %r15
    subq $8, %rsp
    stmxcsr (%rsp)
    fnstcw 4(%rsp)
    movq %rsp, (%rdi)
    movq %rsi, %rsp
    ldmxcsr (%rsp)
    fldcw 4(%rsp)
    addq $8, %rsp
    popq %r15
    popq %r14
    popq %r13
    popq %r12
    popq %rbx
    popq %rbp
    ret
    .size simt_switch, .-simt_switch
)");

enum state { READY, AT_BARRIER, AT_COLLECTIVE, DONE };

struct fiber {
    void *sp;               /* saved stack pointer, while switched away */
    char *stack;
    uint3 idx;
    int warp, lane;
    state st;
    void *fake_stack;       /* ASan's, while switched away */
};

struct warp_state {
    int size;               /* lanes (a block's last warp may have fewer) */
    int live;               /* lanes not returned */
    int arrived;
    int kind;
    unsigned mask;
    uint64_t value[WARP];
    int arg[WARP];
    uint64_t result[WARP];
};

struct block_run {
    fiber *fibers;
    int nthreads;
    int live;
    int at_barrier;
    const char *barrier;    /* the source place of the barrier they wait at */
    warp_state warps[MAX_THREADS / WARP];
    void (*body)(void *);
    void *ctx;
};

fiber g_fibers[MAX_THREADS];
block_run g_block;
fiber *g_self;
void *g_sched_sp;
const void *g_sched_bottom;     /* the scheduler's stack, for ASan */
size_t g_sched_size;
void *g_sched_fake;
pthread_mutex_t g_launch_lock = PTHREAD_MUTEX_INITIALIZER;

void to_scheduler(fiber *f, bool dying)
{
#if SIMT_ASAN
    __sanitizer_start_switch_fiber(dying ? nullptr : &f->fake_stack, g_sched_bottom, g_sched_size);
#endif
    simt_switch(&f->sp, g_sched_sp);
#if SIMT_ASAN
    __sanitizer_finish_switch_fiber(f->fake_stack, nullptr, nullptr);
#endif
}

void start_fiber(fiber *f);
char *new_stack();

/* Stacks of fibers that returned, for the next ones: a block that never waits runs all
 * its threads on one stack, which stays in the cache (a thread's frame holds its copy of
 * the kernel arguments, up to 32 KB). */
std::vector<char *> g_free_stacks;

void to_fiber(fiber *f)
{
    if (!f->stack) {            /* its first run */
        if (g_free_stacks.empty()) {
            f->stack = new_stack();
        } else {
            f->stack = g_free_stacks.back();
            g_free_stacks.pop_back();
        }
        start_fiber(f);
    }
    g_self = f;
    simt::self_idx = &f->idx;
#if SIMT_ASAN
    __sanitizer_start_switch_fiber(&g_sched_fake, f->stack, STACK_BYTES);
#endif
    simt_switch(&g_sched_sp, f->sp);
#if SIMT_ASAN
    __sanitizer_finish_switch_fiber(g_sched_fake, &g_sched_bottom, &g_sched_size);
#endif
    if (f->st == DONE) {
        g_free_stacks.push_back(f->stack);
        f->stack = nullptr;
    }
}

void thread_exits(fiber *f);

void fiber_main()
{
    fiber *f = g_self;
#if SIMT_ASAN
    __sanitizer_finish_switch_fiber(nullptr, &g_sched_bottom, &g_sched_size);
#endif
    g_block.body(g_block.ctx);
    thread_exits(f);
    to_scheduler(f, true);
    die("a returned thread was resumed");
}

/* Lets every fiber waiting at the barrier go on in the next round. */
void release_barrier()
{
    for (int t = 0; t < g_block.nthreads; t++)
        if (g_block.fibers[t].st == AT_BARRIER)
            g_block.fibers[t].st = READY;
    g_block.at_barrier = 0;
}

void thread_exits(fiber *f)
{
    warp_state *w = &g_block.warps[f->warp];
    f->st = DONE;
    g_block.live--;
    w->live--;
    if (w->arrived > 0)
        die("lane %d of warp %d of block %u returned while %d of its lanes wait in a warp "
            "collective", f->lane, f->warp, simt::block_idx.x, w->arrived);
    /* lanes that returned no longer count at a barrier (as on sm_70 and newer) */
    if (g_block.at_barrier > 0 && g_block.at_barrier == g_block.live)
        release_barrier();
}

/* Makes f start at fiber_main: a frame simt_switch pops (control words as the caller's,
 * registers 0, return address fiber_main), then a null return address for fiber_main,
 * which never returns; fiber_main starts with the stack as after a call (rsp = 8 mod 16). */
void start_fiber(fiber *f)
{
    uint64_t *top = (uint64_t *)(f->stack + STACK_BYTES);
    uint64_t *sp = top - 9;
    uint32_t mxcsr;
    uint16_t x87;

    asm volatile("stmxcsr %0\n\tfnstcw %1" : "=m"(mxcsr), "=m"(x87));
    memset(sp, 0, 9 * sizeof(*sp));
    sp[0] = mxcsr | (uint64_t)x87 << 32;
    sp[7] = (uint64_t)(uintptr_t)fiber_main;
#if SIMT_ASAN
    /* the frame of the fiber that ended here is gone: clear what ASan marked in it */
    __asan_unpoison_memory_region(f->stack + STACK_BYTES - 8192, 8192);
#endif
    f->sp = sp;
}

/* the __shared__ variables of every kernel (simt.h), between these two */
extern "C" char __start_simt_shared[] __attribute__((weak, visibility("hidden")));
extern "C" char __stop_simt_shared[] __attribute__((weak, visibility("hidden")));

void run_block(void (*body)(void *), void *ctx)
{
    int n = g_block.nthreads;
    if (__start_simt_shared)
        memset(__start_simt_shared, 0xff, (size_t)(__stop_simt_shared - __start_simt_shared));
    g_block.body = body;
    g_block.ctx = ctx;
    g_block.live = n;
    g_block.at_barrier = 0;
    for (int w = 0; w * WARP < n; w++) {
        warp_state *ws = &g_block.warps[w];
        ws->size = n - w * WARP < WARP ? n - w * WARP : WARP;
        ws->live = ws->size;
        ws->arrived = 0;
    }
    for (int t = 0; t < n; t++)
        g_block.fibers[t].st = READY;      /* each starts on a stack at its first run */
    std::vector<int> ready;
    ready.reserve(n);
    while (g_block.live > 0) {
        ready.clear();
        for (int t = 0; t < n; t++)
            if (g_block.fibers[t].st == READY)
                ready.push_back(t);
        if (ready.empty())
            die("deadlock in block %u: %d threads wait at __syncthreads, %d in warp collectives",
                simt::block_idx.x, g_block.at_barrier, g_block.live - g_block.at_barrier);
        arrange(ready);
        for (int t : ready)
            to_fiber(&g_block.fibers[t]);
    }
}

char *new_stack()
{
    void *p = mmap(nullptr, STACK_BYTES, PROT_READ | PROT_WRITE,
                   MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE, -1, 0);
    if (p == MAP_FAILED)
        die("no memory for a fiber stack (%s)", strerror(errno));
    return (char *)p;
}

// ---- the launch record ----

struct launch_record {
    char site[48];
    unsigned grid, block;
    size_t param_bytes;
};

std::vector<launch_record> g_record;

}  // namespace

// ---- the execution model ----

namespace simt {

void syncthreads(const char *site)
{
    fiber *f = g_self;
    if (g_block.at_barrier == 0)
        g_block.barrier = site;
    else if (strcmp(site, g_block.barrier) != 0)
        die("threads of block %u wait at two different __syncthreads: %s and %s",
            simt::block_idx.x, g_block.barrier, site);
    f->st = AT_BARRIER;
    if (++g_block.at_barrier == g_block.live)
        release_barrier();          /* the last one waits for the next round too */
    to_scheduler(f, false);
}

uint64_t warp_collective(unsigned mask, enum collective kind, uint64_t bits, int arg)
{
    fiber *f = g_self;
    warp_state *w = &g_block.warps[f->warp];
    unsigned full = w->size == WARP ? 0xffffffffu : (1u << w->size) - 1;
    static const char *names[] = {"__shfl_sync", "__shfl_down_sync", "__reduce_max_sync"};

    if (mask != full || w->live != w->size)
        die("%s with mask %#x in warp %d of block %u, whose live lanes are %d of %d",
            names[kind], mask, f->warp, simt::block_idx.x, w->live, w->size);
    if (w->arrived > 0 && (w->kind != kind || w->mask != mask))
        die("lanes of warp %d of block %u in different collectives (%s and %s)", f->warp,
            simt::block_idx.x, names[kind], names[w->kind]);
    w->kind = kind;
    w->mask = mask;
    w->value[f->lane] = bits;
    w->arg[f->lane] = arg;
    f->st = AT_COLLECTIVE;
    if (++w->arrived == w->live) {          /* all met: every lane's result, then go on */
        unsigned top = 0;
        for (int l = 0; l < w->size; l++)
            top = (unsigned)w->value[l] > top ? (unsigned)w->value[l] : top;
        for (int l = 0; l < w->size; l++) {
            int a = w->arg[l];
            if (kind == SHFL_IDX)
                w->result[l] = w->value[a & (WARP - 1)];
            else if (kind == SHFL_DOWN)
                w->result[l] = l + a < w->size ? w->value[l + a] : w->value[l];
            else
                w->result[l] = top;
        }
        for (int l = 0; l < w->size; l++)
            g_block.fibers[f->warp * WARP + l].st = READY;
        w->arrived = 0;
    }
    to_scheduler(f, false);
    return w->result[f->lane];
}

cudaError_t launch(const char *site, dim3 grid, dim3 block, size_t shared_bytes,
                   cudaStream_t stream, size_t param_bytes, void (*body)(void *), void *ctx)
{
    const device &d = the_device();
    uint64_t threads = (uint64_t)block.x * block.y * block.z;

    if (grid.x == 0 || grid.y == 0 || grid.z == 0 || grid.x > 0x7fffffffu || grid.y > 65535 ||
        grid.z > 65535 || threads == 0 || threads > MAX_THREADS || block.z > 64 ||
        shared_bytes > 48 * 1024)
        return set_error(cudaErrorInvalidConfiguration);
    if (param_bytes > d.param_limit)
        return set_error(cudaErrorInvalidValue);

    pthread_mutex_lock(&g_launch_lock);
    read_settings();
    launch_record r;
    snprintf(r.site, sizeof(r.site), "%s", site);
    r.grid = grid.x * grid.y * grid.z;
    r.block = (unsigned)threads;
    r.param_bytes = param_bytes;
    g_record.push_back(r);
    if (!g_execute) {
        pthread_mutex_unlock(&g_launch_lock);
        return cudaSuccess;
    }

    for (uint64_t t = 0; t < threads; t++) {
        fiber *f = &g_fibers[t];
        f->idx = {(unsigned)(t % block.x), (unsigned)(t / block.x % block.y),
                  (unsigned)(t / ((uint64_t)block.x * block.y))};
        f->warp = (int)(t / WARP);
        f->lane = (int)(t % WARP);
    }
    g_block.fibers = g_fibers;
    g_block.nthreads = (int)threads;
    simt::block_dim = {block.x, block.y, block.z};
    simt::grid_dim = {grid.x, grid.y, grid.z};

    std::vector<int> blocks(grid.x);
    for (unsigned b = 0; b < grid.x; b++)
        blocks[b] = (int)b;
    arrange(blocks);
    for (unsigned z = 0; z < grid.z; z++)
        for (unsigned y = 0; y < grid.y; y++)
            for (int b : blocks) {
                simt::block_idx = {(unsigned)b, y, z};
                run_block(body, ctx);
            }
    pthread_mutex_unlock(&g_launch_lock);
    return cudaSuccess;
}

}  // namespace simt

// ---- runtime API ----

cudaError_t cudaGetLastError(void)
{
    cudaError_t e = last_error;
    last_error = cudaSuccess;
    return e;
}

cudaError_t cudaPeekAtLastError(void)
{
    return last_error;
}

const char *cudaGetErrorName(cudaError_t err)
{
    switch (err) {
    case cudaSuccess: return "cudaSuccess";
    case cudaErrorInvalidValue: return "cudaErrorInvalidValue";
    case cudaErrorInvalidConfiguration: return "cudaErrorInvalidConfiguration";
    case cudaErrorInvalidDevice: return "cudaErrorInvalidDevice";
    }
    return "cudaErrorUnknown";
}

const char *cudaGetErrorString(cudaError_t err)
{
    switch (err) {
    case cudaSuccess: return "no error";
    case cudaErrorInvalidValue: return "invalid argument";
    case cudaErrorInvalidConfiguration: return "invalid configuration argument";
    case cudaErrorInvalidDevice: return "invalid device ordinal";
    }
    return "unknown error";
}

cudaError_t cudaDriverGetVersion(int *version)
{
    *version = the_device().driver;
    return cudaSuccess;
}

cudaError_t cudaRuntimeGetVersion(int *version)
{
    *version = CUDART_VERSION;
    return cudaSuccess;
}

cudaError_t cudaGetDevice(int *device)
{
    *device = 0;
    return cudaSuccess;
}

cudaError_t cudaDeviceGetAttribute(int *value, enum cudaDeviceAttr attr, int device)
{
    const struct device &d = the_device();
    if (device != 0)
        return set_error(cudaErrorInvalidDevice);
    switch (attr) {
    case cudaDevAttrMaxThreadsPerBlock: *value = MAX_THREADS; return cudaSuccess;
    case cudaDevAttrMultiProcessorCount: *value = d.sms; return cudaSuccess;
    case cudaDevAttrComputeCapabilityMajor: *value = d.major; return cudaSuccess;
    case cudaDevAttrComputeCapabilityMinor: *value = d.minor; return cudaSuccess;
    }
    return set_error(cudaErrorInvalidValue);
}

cudaError_t cudaMemsetAsync(void *ptr, int value, size_t bytes, cudaStream_t stream)
{
    if (!ptr && bytes)
        return set_error(cudaErrorInvalidValue);
    memset(ptr, value, bytes);
    return cudaSuccess;
}

// ---- torch's CUDA functions, as the launchers use them (device 0, its null stream) ----

static struct CUDAGuardOpaque *const g_guard = (struct CUDAGuardOpaque *)&g_guard;

AOTITorchError aoti_torch_create_cuda_guard(int32_t device_index, CUDAGuardHandle *ret_guard)
{
    *ret_guard = (CUDAGuardHandle)g_guard;
    return 0;
}

AOTITorchError aoti_torch_delete_cuda_guard(CUDAGuardHandle guard)
{
    return guard == (CUDAGuardHandle)g_guard ? 0 : 1;
}

AOTITorchError aoti_torch_get_current_cuda_stream(int32_t device_index, void **ret_stream)
{
    *ret_stream = nullptr;
    return 0;
}

/* malloc, so that ASan's redzones guard the scratch as they guard every other buffer */
AOTITorchError aoti_torch_cuda_caching_allocator_raw_alloc(uint64_t nbytes, void **ret_ptr)
{
    *ret_ptr = malloc(nbytes ? nbytes : 1);
    return *ret_ptr ? 0 : 1;
}

AOTITorchError aoti_torch_cuda_caching_allocator_raw_delete(void *ptr)
{
    free(ptr);
    return 0;
}

// ---- hooks for the tests ----

/* 0 forward, 1 reverse, 2 shuffled (with `seed`); the setting of later launches. */
EXPORT void ampc_emu_set_order(int order, uint64_t seed)
{
    pthread_mutex_lock(&g_launch_lock);
    read_settings();
    g_order = order == 1 ? REVERSE : order == 2 ? SHUFFLE : FORWARD;
    g_seed = seed;
    pthread_mutex_unlock(&g_launch_lock);
}

EXPORT int ampc_emu_order(void)
{
    pthread_mutex_lock(&g_launch_lock);
    read_settings();
    int o = g_order;
    pthread_mutex_unlock(&g_launch_lock);
    return o;
}

/* 0: launches are checked and recorded but run no thread (plans of huge lists). */
EXPORT void ampc_emu_set_execute(int on)
{
    pthread_mutex_lock(&g_launch_lock);
    g_execute = on;
    pthread_mutex_unlock(&g_launch_lock);
}

EXPORT const char *ampc_emu_device(void)
{
    return the_device().name;
}

EXPORT void ampc_emu_clear_launches(void)
{
    pthread_mutex_lock(&g_launch_lock);
    g_record.clear();
    pthread_mutex_unlock(&g_launch_lock);
}

EXPORT int64_t ampc_emu_launch_count(void)
{
    pthread_mutex_lock(&g_launch_lock);
    int64_t n = (int64_t)g_record.size();
    pthread_mutex_unlock(&g_launch_lock);
    return n;
}

/* Launch i of the record: its site (the launching function), grid, block and argument
 * bytes; 0, or 1 when there is no launch i. */
EXPORT int ampc_emu_launch(int64_t i, char *site, int site_size, int64_t *grid, int64_t *block,
                           int64_t *param_bytes)
{
    pthread_mutex_lock(&g_launch_lock);
    int found = i >= 0 && i < (int64_t)g_record.size();
    if (found) {
        const launch_record &r = g_record[(size_t)i];
        snprintf(site, (size_t)site_size, "%s", r.site);
        *grid = r.grid;
        *block = r.block;
        *param_bytes = (int64_t)r.param_bytes;
    }
    pthread_mutex_unlock(&g_launch_lock);
    return found ? 0 : 1;
}
