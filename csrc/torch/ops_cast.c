/*
 * ops_cast.c: torch.ops.ampc.cast in the torch glue: its arguments taken off the stack and
 * checked, then the cast kernel run, once per dtype group when the lists mix dtypes.
 */
#include "call.h"

// ---- cast(Tensor(a!)[] dst, Tensor[] src, Tensor[] seed_tensor, bool stochastic,
//           int seed) ----

struct cast_job {
    struct ampc_list dst;
    struct ampc_list src;
    struct ampc_cast_args args;
};

ON_DEVICES(cast, cast_job, &job->dst, &job->src, &job->args)

void ampc_op_cast(StableIValue *stack, int on_cuda)
{
    struct call c;
    start(&c, "ampc.cast", on_cuda);
    struct list *dst = take_list(&c, stack[0], "dst", 1);
    struct list *src = take_list(&c, stack[1], "src", 0);
    struct list *seed = take_option(&c, stack[2], "seed_tensor");
    describe_all(&c);
    struct cast_job job;
    int mixed = 0;
    job.dst = float_list_mixed(&c, dst, &mixed);
    job.src = float_list_mixed(&c, src, &mixed);
    check_same_shapes(&c, dst, "dst", src, "src");
    job.args.seed_tensor = option(&c, seed, "seed_tensor", aoti_torch_dtype_int64());
    check_overlap(&c);
    job.args.stochastic = take_bool(stack[3]);
    job.args.seed = (uint64_t)stack[4];
    struct list *lists[2] = { dst, src };
    struct ampc_list *outs[2] = { &job.dst, &job.src };
    run_groups(&c, mixed, lists, outs, 2, cast_on_cpu, cast_on_cuda, &job);
    call_free(&c);
}

