/*
 * ops_cast.c: torch.ops.ampc.cast in the torch glue: its arguments checked, then the cast
 * kernel run, once per dtype group when the lists mix dtypes.
 */
#include "call.h"

struct cast_job {
    struct ampc_list dst;
    struct ampc_list src;
    struct ampc_cast_args args;
};

ON_DEVICES(cast, cast_job, &job->dst, &job->src, &job->args)

void ampc_op_cast(struct call *c, struct cast_args *a)
{
    describe_all(c);
    struct cast_job job;
    int mixed = 0;
    job.dst = float_list_mixed(c, a->dst, &mixed);
    job.src = float_list_mixed(c, a->src, &mixed);
    check_same_shapes(c, a->dst, "dst", a->src, "src");
    job.args.seed_tensor = option(c, a->seed_tensor, "seed_tensor", aoti_torch_dtype_int64());
    check_overlap(c);
    job.args.stochastic = a->stochastic;
    job.args.seed = (uint64_t)a->seed;
    struct list *lists[2] = { a->dst, a->src };
    struct ampc_list *outs[2] = { &job.dst, &job.src };
    run_groups(c, mixed, lists, outs, 2, cast_on_cpu, cast_on_cuda, &job);
}
