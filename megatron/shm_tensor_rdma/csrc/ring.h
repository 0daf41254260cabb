// A bounded multi-producer multi-consumer queue of fixed-size slots that lives in shared
// memory. It follows Vyukov's bounded-queue scheme: every slot carries a sequence number, so a
// producer and a consumer only touch the slot they claimed and never share a lock. Positions
// are 32-bit and wrap; the slot count is a power of two so the wrap stays consistent.
#pragma once

#include <atomic>
#include <cstddef>
#include <cstdint>

#include "common.h"

namespace strdma {

struct alignas(64) RingHeader {
  std::atomic<uint32_t> head;  // next position a consumer takes
  char pad0[60];
  std::atomic<uint32_t> tail;  // next position a producer claims
  char pad1[60];
  // Event count for producers waiting for a free slot (futex word) and how many wait on it,
  // so the consumer only pays for a wake syscall when someone sleeps.
  std::atomic<uint32_t> space_events;
  std::atomic<uint32_t> space_waiters;
  uint32_t slots;
  uint32_t slot_payload;  // usable bytes per slot
  uint32_t slot_stride;   // bytes between slot starts
  char pad2[44];
};
static_assert(sizeof(RingHeader) == 192, "ring header layout is shared between processes");

struct alignas(64) SlotHeader {
  std::atomic<uint32_t> seq;
  uint32_t bytes;  // bytes written by the producer
  char pad[56];
};

class Ring {
 public:
  static size_t stride_for(uint32_t slot_payload) {
    return (sizeof(SlotHeader) + slot_payload + 63) / 64 * 64;
  }
  static size_t bytes_needed(uint32_t slots, uint32_t slot_payload) {
    return sizeof(RingHeader) + static_cast<size_t>(slots) * stride_for(slot_payload);
  }
  // Builds an empty ring at `at` (owner side, before any peer can see the memory).
  static void initialize(void* at, uint32_t slots, uint32_t slot_payload) {
    auto* h = new (at) RingHeader();
    h->head.store(0);
    h->tail.store(0);
    h->space_events.store(0);
    h->space_waiters.store(0);
    h->slots = slots;
    h->slot_payload = slot_payload;
    h->slot_stride = static_cast<uint32_t>(stride_for(slot_payload));
    for (uint32_t i = 0; i < slots; ++i) {
      auto* s = new (reinterpret_cast<char*>(h + 1) + static_cast<size_t>(i) * h->slot_stride) SlotHeader();
      s->seq.store(i);
      s->bytes = 0;
    }
  }

  Ring() = default;
  // The geometry is copied out of the shared header: it never changes, and reading it there on
  // every message would miss the cache whenever the other side touched that header line.
  explicit Ring(void* at)
      : h_(static_cast<RingHeader*>(at)),
        slots_(h_->slots),
        slot_payload_(h_->slot_payload),
        slot_stride_(h_->slot_stride),
        slot0_(reinterpret_cast<char*>(h_ + 1)) {}

  bool valid() const { return h_ != nullptr; }
  uint32_t slot_payload() const { return slot_payload_; }
  uint32_t slots() const { return slots_; }

  char* payload(uint32_t pos) const { return reinterpret_cast<char*>(slot(pos) + 1); }
  uint32_t bytes(uint32_t pos) const { return slot(pos)->bytes; }

  // Producer: claims the next free slot. False when the ring is full.
  bool try_claim(uint32_t* pos_out) {
    uint32_t pos = h_->tail.load(std::memory_order_relaxed);
    for (;;) {
      uint32_t seq = slot(pos)->seq.load(std::memory_order_acquire);
      int32_t diff = static_cast<int32_t>(seq - pos);
      if (diff == 0) {
        if (h_->tail.compare_exchange_weak(pos, pos + 1, std::memory_order_relaxed)) {
          *pos_out = pos;
          return true;
        }
      } else if (diff < 0) {
        return false;
      } else {
        pos = h_->tail.load(std::memory_order_relaxed);
      }
    }
  }

  void publish(uint32_t pos, uint32_t nbytes) {
    slot(pos)->bytes = nbytes;
    slot(pos)->seq.store(pos + 1, std::memory_order_release);
  }

  // Consumer: takes the oldest published slot. False when the head slot is not published yet.
  bool try_take(uint32_t* pos_out) {
    uint32_t pos = h_->head.load(std::memory_order_relaxed);
    for (;;) {
      uint32_t seq = slot(pos)->seq.load(std::memory_order_acquire);
      int32_t diff = static_cast<int32_t>(seq - (pos + 1));
      if (diff == 0) {
        if (h_->head.compare_exchange_weak(pos, pos + 1, std::memory_order_relaxed)) {
          *pos_out = pos;
          return true;
        }
      } else if (diff < 0) {
        return false;
      } else {
        pos = h_->head.load(std::memory_order_relaxed);
      }
    }
  }

  // True when the head slot holds published data (used to drain a departed peer's messages).
  bool has_published() const {
    uint32_t pos = h_->head.load(std::memory_order_acquire);
    return slot(pos)->seq.load(std::memory_order_acquire) == pos + 1;
  }

  // Consumer: returns the slot to producers and wakes any producer waiting for space.
  void release(uint32_t pos) {
    slot(pos)->seq.store(pos + slots_, std::memory_order_release);
    // Dekker-style against claim_blocking (waiters++, then try_claim): either the waiter sees
    // this slot free, or we see the waiter and bump the event count it sleeps on. Without a
    // waiter the header line stays untouched.
    std::atomic_thread_fence(std::memory_order_seq_cst);
    if (h_->space_waiters.load(std::memory_order_seq_cst) > 0) {
      h_->space_events.fetch_add(1, std::memory_order_seq_cst);
      futex_wake(&h_->space_events, INT_MAX);
    }
  }

  // Producer: claims a slot, sleeping until one frees up. `keep_waiting` is asked between
  // sleeps so that a departed peer or a cancelled transfer ends the wait.
  template <class KeepWaiting>
  bool claim_blocking(uint32_t* pos_out, KeepWaiting keep_waiting) {
    for (;;) {
      uint32_t events = h_->space_events.load(std::memory_order_seq_cst);
      if (try_claim(pos_out)) return true;
      if (!keep_waiting()) return false;
      h_->space_waiters.fetch_add(1, std::memory_order_seq_cst);
      if (try_claim(pos_out)) {
        h_->space_waiters.fetch_sub(1, std::memory_order_seq_cst);
        return true;
      }
      futex_wait(&h_->space_events, events, 20 * 1000 * 1000);
      h_->space_waiters.fetch_sub(1, std::memory_order_seq_cst);
    }
  }

  // Wakes producers sleeping in claim_blocking (used when the consumer side goes away).
  void wake_producers() {
    h_->space_events.fetch_add(1, std::memory_order_seq_cst);
    futex_wake(&h_->space_events, INT_MAX);
  }

 private:
  SlotHeader* slot(uint32_t pos) const {
    return reinterpret_cast<SlotHeader*>(slot0_ + static_cast<size_t>(pos & (slots_ - 1)) * slot_stride_);
  }

  RingHeader* h_ = nullptr;
  uint32_t slots_ = 0;
  uint32_t slot_payload_ = 0;
  uint32_t slot_stride_ = 0;
  char* slot0_ = nullptr;
};

}  // namespace strdma
